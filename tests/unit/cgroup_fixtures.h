// /proc/self/mountinfo texts as the kernel writes them, for the cgroup tests
// (test_cgroup.cpp, test_cpu_budget.cpp, test_train_memory.cpp): a v2-only
// system and a hybrid one (v2 at unified/, v1 cpu,cpuacct and memory beside it).
#pragma once

namespace loom::test_util {

inline constexpr const char* kMountCgroup2 =
    "30 24 0:26 / /sys/fs/cgroup rw,nosuid,nodev,noexec,relatime shared:4 - cgroup2 cgroup2 rw,nsdelegate\n";
inline constexpr const char* kMountHybrid =
    "25 24 0:22 / /sys/fs/cgroup ro,nosuid - tmpfs tmpfs ro,mode=755\n"
    "26 25 0:23 / /sys/fs/cgroup/unified rw,nosuid - cgroup2 cgroup2 rw\n"
    "28 25 0:25 / /sys/fs/cgroup/cpu,cpuacct rw,nosuid shared:9 - cgroup cgroup rw,cpu,cpuacct\n"
    "29 25 0:26 / /sys/fs/cgroup/memory rw,nosuid - cgroup cgroup rw,memory\n";

}  // namespace loom::test_util
