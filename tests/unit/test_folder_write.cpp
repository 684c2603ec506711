// Whole-folder writes (io/file_write.h write_folder_atomic) and the PEFT
// adapter writer on top of them: a child process SIGKILLed at every commit
// step, and at random moments while rewriting, always leaves an adapter folder
// that loads as the old one or the new one; foreign folders are refused.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <functional>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "core/mapped_file.h"
#include "expect_error.h"
#include "io/file_write.h"
#include "model/peft_adapter.h"

namespace loom {
namespace {

namespace fs = std::filesystem;

struct TempDir {
  fs::path path;
  explicit TempDir(const std::string& tag) {
    path = fs::temp_directory_path() / ("loom_folder_" + tag + "_" + std::to_string(::getpid()));
    fs::remove_all(path);
    fs::create_directories(path);
  }
  ~TempDir() { fs::remove_all(path); }
};

void put(const fs::path& p, const std::string& text) {
  fs::create_directories(p.parent_path());
  std::ofstream(p) << text;
}

// Names in `dir` other than `keep` (leftover staging or backup folders).
std::vector<std::string> others(const fs::path& dir, const std::string& keep) {
  std::vector<std::string> v;
  for (const auto& e : fs::directory_iterator(dir))
    if (e.path().filename() != keep) v.push_back(e.path().filename().string());
  return v;
}

// An adapter whose every value is `r`, so a folder mixing two writes is caught
// both by the shapes (A is [r, in]) and by the values.
peft::AdapterTensors adapter_of_rank(int r, int64_t width) {
  peft::AdapterTensors ad;
  ad.config.r = r;
  ad.config.lora_alpha = 2 * r;
  ad.config.target_modules = {LoraTarget::q, LoraTarget::v};
  for (int l = 0; l < 2; ++l)
    for (LoraTarget t : ad.config.target_modules) {
      peft::LoraPair p;
      p.in = width;
      p.out = width;
      p.a.assign(static_cast<size_t>(r * width), static_cast<float>(r));
      p.b.assign(static_cast<size_t>(r * width), static_cast<float>(r));
      ad.pairs.emplace(std::make_pair(l, t), std::move(p));
    }
  return ad;
}

// Reads the folder; returns its rank after checking every value matches it.
int loaded_rank(const std::string& dir) {
  const peft::AdapterTensors ad = peft::read_adapter(dir);
  const int r = ad.config.r;
  for (const auto& [key, p] : ad.pairs) {
    for (float x : p.a) EXPECT_EQ(x, static_cast<float>(r)) << dir;
    for (float x : p.b) EXPECT_EQ(x, static_cast<float>(r)) << dir;
  }
  return r;
}

TEST(FolderWrite, CreatesThenReplacesWithoutLeftovers) {
  TempDir tmp("replace");
  const fs::path dest = tmp.path / "out";
  write_folder_atomic(dest.string(), [](const std::string& s) { write_file_atomic(s + "/a.txt", "one"); });
  EXPECT_EQ(read_text_file((dest / "a.txt").string()), "one");
  put(dest / "adapter_config.json", "{}");  // a loom/PEFT output: may be replaced
  write_folder_atomic(dest.string(), [](const std::string& s) { write_file_atomic(s + "/b.txt", "two"); });
  EXPECT_FALSE(fs::exists(dest / "a.txt"));  // replaced as a whole, not merged
  EXPECT_EQ(read_text_file((dest / "b.txt").string()), "two");
  EXPECT_TRUE(others(tmp.path, "out").empty());
}

// The published folder gets the mode the umask gives any new folder (it was mkdtemp's 0700: a server
// running as another user could not read an adapter written for it).
TEST(FolderWrite, PublishedFolderFollowsTheUmask) {
  TempDir tmp("mode");
  const mode_t before = ::umask(022);
  write_folder_atomic((tmp.path / "out").string(),
                      [](const std::string& s) { write_file_atomic(s + "/a.txt", "x"); });
  ::umask(027);
  write_folder_atomic((tmp.path / "out2").string(),
                      [](const std::string& s) { write_file_atomic(s + "/a.txt", "x"); });
  ::umask(before);
  EXPECT_EQ(fs::status(tmp.path / "out").permissions(), fs::perms(0755));
  EXPECT_EQ(fs::status(tmp.path / "out2").permissions(), fs::perms(0750));
}

TEST(FolderWrite, FailedFillLeavesTheOldFolder) {
  TempDir tmp("fillfail");
  const fs::path dest = tmp.path / "out";
  put(dest / "config.json", "old");
  put(dest / "model.safetensors", "old");
  EXPECT_THROW(write_folder_atomic(dest.string(),
                                   [](const std::string& s) {
                                     write_file_atomic(s + "/config.json", "new");
                                     fail(ErrorKind::io, "disk full");
                                   }),
               Error);
  EXPECT_EQ(read_text_file((dest / "config.json").string()), "old");
  EXPECT_TRUE(others(tmp.path, "out").empty());
}

TEST(FolderWrite, RefusesFoldersThatAreNotOutputs) {
  TempDir tmp("refuse");
  const fs::path dest = tmp.path / "notes";
  put(dest / "my-notes.txt", "keep me");
  const auto fill = [](const std::string& s) { write_file_atomic(s + "/adapter_config.json", "{}"); };
  test_util::expect_error([&] { write_folder_atomic(dest.string(), fill); }, ErrorKind::invalid_input,
                          {dest.string(), "my-notes.txt", "not a loom or PEFT output", "--overwrite"});
  EXPECT_EQ(read_text_file((dest / "my-notes.txt").string()), "keep me");
  FolderWriteOptions opt;
  opt.overwrite = true;
  write_folder_atomic(dest.string(), fill, opt);
  EXPECT_FALSE(fs::exists(dest / "my-notes.txt"));
  EXPECT_TRUE(fs::exists(dest / "adapter_config.json"));

  put(tmp.path / "file", "x");
  test_util::expect_error([&] { write_folder_atomic((tmp.path / "file").string(), fill, opt); },
                          ErrorKind::invalid_input, {"exists and is not a folder"});
  const fs::path cwd = fs::current_path();
  fs::current_path(dest);
  test_util::expect_error([&] { write_folder_atomic(".", fill, opt); }, ErrorKind::invalid_input,
                          {"holds the current directory"});
  test_util::expect_error([&] { write_folder_atomic(tmp.path.string(), fill, opt); }, ErrorKind::invalid_input,
                          {"holds the current directory"});
  fs::current_path(cwd);
}

TEST(FolderWrite, EmptyAndModelFoldersAreReplaceable) {
  TempDir tmp("kinds");
  fs::create_directories(tmp.path / "empty");
  EXPECT_NO_THROW(check_folder_replaceable((tmp.path / "empty").string(), false, "o", "--overwrite"));
  put(tmp.path / "model" / "config.json", "{}");
  put(tmp.path / "model" / "model-00001-of-00002.safetensors", "");
  EXPECT_TRUE(is_model_or_adapter_folder((tmp.path / "model").string()));
  put(tmp.path / "cfg_only" / "config.json", "{}");
  EXPECT_FALSE(is_model_or_adapter_folder((tmp.path / "cfg_only").string()));
  EXPECT_NO_THROW(check_folder_replaceable((tmp.path / "missing").string(), false, "o", "--overwrite"));
}

TEST(FolderWrite, WritableChecks) {
  TempDir tmp("writable");
  put(tmp.path / "file", "x");
  test_util::expect_error([&] { check_folder_writable((tmp.path / "file" / "out").string(), "output_dir"); },
                          ErrorKind::io, {"output_dir", "cannot create its parent folder"});
  test_util::expect_error([&] { check_dir_writable((tmp.path / "file").string(), "data.cache_dir"); }, ErrorKind::io,
                          {"data.cache_dir", "not a folder"});
  test_util::expect_error([&] { check_dir_writable((tmp.path / "file" / "c").string(), "data.cache_dir"); },
                          ErrorKind::io, {"data.cache_dir", "cannot create"});
  EXPECT_NO_THROW(check_folder_writable((tmp.path / "a" / "b" / "out").string(), "output_dir"));
  EXPECT_TRUE(others(tmp.path / "a" / "b", "").empty());  // the probe is gone
  EXPECT_NO_THROW(check_dir_writable((tmp.path / "cache").string(), "data.cache_dir"));
  EXPECT_TRUE(others(tmp.path / "cache", "").empty());
}

// Forks a child that runs `body` and is SIGKILLed by it or by the parent after
// `kill_after` (when set); returns once the child is gone.
void run_child(const std::function<void()>& body, std::optional<std::chrono::microseconds> kill_after = {}) {
  const pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    try {
      body();
    } catch (...) {
      ::_exit(3);
    }
    ::_exit(0);
  }
  if (kill_after) {
    std::this_thread::sleep_for(*kill_after);
    ::kill(pid, SIGKILL);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  if (!kill_after) {
    ASSERT_TRUE(WIFSIGNALED(status)) << "the child should have been killed at its step";
  } else {
    ASSERT_FALSE(WIFEXITED(status) && WEXITSTATUS(status) == 3) << "the child's write failed";
  }
}

TEST(FolderWriteCrash, KilledAtEveryCommitStepLoadsOldOrNew) {
  for (const bool exchange : {true, false}) {
    // Steps before the new folder is in place leave r=8; after it, r=16.
    const std::vector<std::pair<std::string, int>> steps =
        exchange ? std::vector<std::pair<std::string, int>>{{"staged", 8}, {"synced", 8}, {"swapped", 16},
                                                            {"parent_synced", 16}, {"done", 16}}
                 : std::vector<std::pair<std::string, int>>{{"staged", 8}, {"synced", 8}, {"old_moved", 8},
                                                            {"new_moved", 16}, {"parent_synced", 16}, {"done", 16}};
    for (const auto& [kill_at, want] : steps) {
      SCOPED_TRACE(fmt::format("exchange {} killed after '{}'", exchange, kill_at));
      TempDir tmp("crash");
      const std::string dest = (tmp.path / "adapter").string();
      peft::write_adapter(dest, adapter_of_rank(8, 32));
      run_child([&, kill_at = kill_at] {
        FolderWriteOptions opt;
        opt.exchange = exchange;
        opt.on_step = [&](std::string_view s) {
          if (s == kill_at) ::raise(SIGKILL);
        };
        peft::write_adapter(dest, adapter_of_rank(16, 32), safetensors::StDType::f32, opt);
      });
      if (kill_at == "old_moved") {
        // The one window of the two-rename fallback: the old folder waits, complete, beside the destination.
        EXPECT_FALSE(fs::exists(dest));
        EXPECT_TRUE(recover_folder_write(dest));
      }
      EXPECT_EQ(loaded_rank(dest), want);
      recover_folder_write(dest);  // what the next write does first: no leftovers of the dead child remain
      EXPECT_TRUE(others(tmp.path, "adapter").empty()) << others(tmp.path, "adapter").front();
      peft::write_adapter(dest, adapter_of_rank(4, 32));  // and the destination is writable again
      EXPECT_EQ(loaded_rank(dest), 4);
    }
  }
}

TEST(FolderWriteCrash, KilledAtRandomMomentsLoadsOldOrNew) {
  TempDir tmp("random");
  const std::string dest = (tmp.path / "adapter").string();
  peft::write_adapter(dest, adapter_of_rank(8, 512));
  std::mt19937 rng(1234);
  int saw_old = 0, saw_new = 0, interrupted = 0;
  for (int i = 0; i < 40; ++i) {
    const bool exchange = i % 2 == 0;
    run_child(
        [&] {
          FolderWriteOptions opt;
          opt.exchange = exchange;
          for (int k = 0;; ++k) peft::write_adapter(dest, adapter_of_rank(k % 2 ? 8 : 16, 512), safetensors::StDType::f32, opt);
        },
        std::chrono::microseconds(std::uniform_int_distribution<int>(200, 30000)(rng)));
    interrupted += !others(tmp.path, "adapter").empty();  // killed inside a write, not between two
    recover_folder_write(dest);  // only the two-rename window needs it; a no-op otherwise
    const int r = loaded_rank(dest);
    ASSERT_TRUE(r == 8 || r == 16) << r;
    (r == 8 ? saw_old : saw_new)++;
  }
  EXPECT_EQ(saw_old + saw_new, 40);
  EXPECT_GT(interrupted, 0) << "no kill landed inside a write";
  std::printf("old %d, new %d, killed inside a write %d of 40\n", saw_old, saw_new, interrupted);
  EXPECT_TRUE(others(tmp.path, "adapter").empty());
}

}  // namespace
}  // namespace loom
