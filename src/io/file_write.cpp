// Atomic whole-file and whole-folder writes and the FNV-1a checksum (see file_write.h).
#include "io/file_write.h"

#include <fcntl.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <system_error>
#include <vector>

#include "core/error.h"

namespace loom {

namespace fs = std::filesystem;

namespace {

void fsync_path(const fs::path& p, bool dir) {
  const int fd = ::open(p.c_str(), O_RDONLY | O_CLOEXEC | (dir ? O_DIRECTORY : 0));
  if (fd < 0) fail(ErrorKind::io, "{}: cannot open to sync: {}", p.string(), std::strerror(errno));
  const int rc = ::fsync(fd);
  const int err = errno;
  ::close(fd);
  if (rc != 0) fail(ErrorKind::io, "{}: fsync failed: {}", p.string(), std::strerror(err));
}

// Every file and folder below `root`, then `root` itself.
void fsync_tree(const fs::path& root) {
  for (const auto& e : fs::recursive_directory_iterator(root)) {
    if (e.is_symlink()) continue;
    if (e.is_regular_file()) fsync_path(e.path(), false);
    else if (e.is_directory()) fsync_path(e.path(), true);
  }
  fsync_path(root, true);
}

// The destination as an absolute path with a file name ("out/" -> /cwd/out;
// a symbolic link -> its target, so the link is not replaced by a folder).
fs::path target_of(const std::string& dest) {
  fs::path p = fs::absolute(dest).lexically_normal();
  if (!p.has_filename()) p = p.parent_path();
  std::error_code ec;
  if (fs::is_symlink(p, ec)) {
    const fs::path t = fs::canonical(p, ec);
    if (!ec) p = t;
  }
  return p;
}

bool holds_current_dir(const fs::path& p) {
  std::error_code ec;
  const fs::path cwd = fs::current_path(ec);
  const fs::path full = fs::weakly_canonical(p, ec);
  if (ec) return false;
  const auto [a, b] = std::mismatch(full.begin(), full.end(), cwd.begin(), cwd.end());
  (void)b;
  return a == full.end();
}

// ".NAME.loom-KIND-PID-" : the prefix of this process's siblings of `p`.
std::string sibling_prefix(const fs::path& p, std::string_view kind) {
  return fmt::format(".{}.loom-{}-", p.filename().string(), kind);
}

// Creates an empty, uniquely named sibling folder of `p`. mkdir with 0777, so the umask gives it the
// mode any folder the user makes gets (mkdtemp's 0700 became the published folder's mode: a server
// running as another user could not read an adapter written for it).
fs::path make_sibling(const fs::path& p, std::string_view kind) {
  static constexpr char kChars[] = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789";
  std::random_device rd;
  for (int attempt = 0;; ++attempt) {
    std::string suffix(6, 'x');
    for (char& ch : suffix) ch = kChars[rd() % (sizeof kChars - 1)];
    const fs::path name =
        p.parent_path() / (sibling_prefix(p, kind) + fmt::format("{}-{}", ::getpid(), suffix));
    if (::mkdir(name.c_str(), 0777) == 0) return name;
    if (errno != EEXIST || attempt == 100)
      fail(ErrorKind::io, "{}: cannot create a folder beside it in {}: {}", p.string(),
           p.parent_path().string(), std::strerror(errno));
  }
}

// PID of a sibling named PREFIX + "PID-XXXXXX", or -1.
long sibling_pid(const std::string& name, const std::string& prefix) {
  if (!name.starts_with(prefix)) return -1;
  const std::string rest = name.substr(prefix.size());
  const auto dash = rest.find('-');
  if (dash == 0 || dash == std::string::npos) return -1;
  for (size_t i = 0; i < dash; ++i)
    if (rest[i] < '0' || rest[i] > '9') return -1;
  return std::strtol(rest.substr(0, dash).c_str(), nullptr, 10);
}

bool process_runs(long pid) { return pid == ::getpid() || ::kill(static_cast<pid_t>(pid), 0) == 0 || errno == EPERM; }

void rename_or_fail(const fs::path& from, const fs::path& to, const fs::path& dest) {
  if (::rename(from.c_str(), to.c_str()) != 0)
    fail(ErrorKind::io, "{}: cannot rename {} to {}: {}", dest.string(), from.string(), to.string(),
         std::strerror(errno));
}

// Swaps `a` and `b` atomically; false when the file system cannot.
bool exchange_paths(const fs::path& a, const fs::path& b, const fs::path& dest) {
#if defined(__linux__) && defined(RENAME_EXCHANGE)
  if (::renameat2(AT_FDCWD, a.c_str(), AT_FDCWD, b.c_str(), RENAME_EXCHANGE) == 0) return true;
  if (errno == EINVAL || errno == ENOSYS || errno == ENOTSUP || errno == EOPNOTSUPP) return false;
  fail(ErrorKind::io, "{}: cannot swap in {}: {}", dest.string(), a.string(), std::strerror(errno));
#else
  (void)a, (void)b, (void)dest;
  return false;
#endif
}

// Recreates `from` at `to`: folders made, files hard-linked (copied where a
// link fails), symbolic links copied as links.
void carry_entry(const fs::path& from, const fs::path& to) {
  std::error_code ec;
  const fs::file_status st = fs::symlink_status(from, ec);
  if (fs::is_symlink(st)) {
    fs::copy_symlink(from, to, ec);
  } else if (fs::is_directory(st)) {
    fs::create_directory(to, ec);
    for (const auto& e : fs::directory_iterator(from, ec)) carry_entry(e.path(), to / e.path().filename());
  } else if (fs::is_regular_file(st)) {
    fs::create_hard_link(from, to, ec);
    if (ec) fs::copy_file(from, to, ec);
  } else {
    return;
  }
  if (ec) fail(ErrorKind::io, "{}: cannot carry it into {}: {}", from.string(), to.string(), ec.message());
}

}  // namespace

void write_file_atomic(const std::string& path, std::string_view bytes) {
  std::error_code ec;
  const auto parent = fs::path(path).parent_path();
  if (!parent.empty()) {
    fs::create_directories(parent, ec);
    if (ec) fail(ErrorKind::io, "{}: cannot create folder {}: {}", path, parent.string(), ec.message());
  }
  const std::string tmp = path + ".tmp";
  {
    std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
    if (!f) fail(ErrorKind::io, "{}: cannot open {} for writing", path, tmp);
    f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    if (!f.flush()) {
      f.close();
      std::remove(tmp.c_str());
      fail(ErrorKind::io, "{}: write failed ({} bytes to {})", path, bytes.size(), tmp);
    }
  }
  try {  // the data must be on disk before the rename makes it visible
    fsync_path(tmp, false);
  } catch (const Error&) {
    std::remove(tmp.c_str());
    throw;
  }
  fs::rename(tmp, path, ec);
  if (ec) {
    std::remove(tmp.c_str());
    fail(ErrorKind::io, "{}: cannot rename {} over it: {}", path, tmp, ec.message());
  }
}

AtomicFileWriter::AtomicFileWriter(std::string path) : path_(std::move(path)) {
  std::error_code ec;
  const auto parent = fs::path(path_).parent_path();
  if (!parent.empty()) {
    fs::create_directories(parent, ec);
    if (ec) fail(ErrorKind::io, "{}: cannot create folder {}: {}", path_, parent.string(), ec.message());
  }
  tmp_ = path_ + ".tmp." + std::to_string(getpid());
  fd_ = ::open(tmp_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd_ < 0) fail(ErrorKind::io, "{}: cannot open {} for writing: {}", path_, tmp_, std::strerror(errno));
  buf_.reserve(size_t{4} << 20);
}

AtomicFileWriter::~AtomicFileWriter() {
  if (fd_ >= 0) {
    ::close(fd_);
    ::unlink(tmp_.c_str());
  }
}

void AtomicFileWriter::flush_buffer() {
  size_t off = 0;
  while (off < buf_.size()) {
    const ssize_t n = ::write(fd_, buf_.data() + off, buf_.size() - off);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) fail(ErrorKind::io, "{}: write failed after {} bytes: {}", path_, written_, std::strerror(errno));
    off += static_cast<size_t>(n);
  }
  buf_.clear();
}

void AtomicFileWriter::write(const void* data, size_t n) {
  LOOM_ASSERT(fd_ >= 0 && "write after commit");
  const auto* p = static_cast<const char*>(data);
  written_ += n;
  while (n > 0) {
    const size_t take = std::min(n, buf_.capacity() - buf_.size());
    buf_.insert(buf_.end(), p, p + take);
    p += take;
    n -= take;
    if (buf_.size() == buf_.capacity()) flush_buffer();
  }
}

void AtomicFileWriter::pad_to(size_t alignment) {
  static constexpr char kZeros[64] = {};
  size_t pad = (alignment - written_ % alignment) % alignment;
  while (pad > 0) {
    const size_t n = std::min(pad, sizeof(kZeros));
    write(kZeros, n);
    pad -= n;
  }
}

void AtomicFileWriter::commit() {
  LOOM_ASSERT(fd_ >= 0 && "commit twice");
  flush_buffer();
  if (::fsync(fd_) != 0) fail(ErrorKind::io, "{}: fsync of {} failed: {}", path_, tmp_, std::strerror(errno));
  ::close(fd_);
  fd_ = -1;
  std::error_code ec;
  fs::rename(tmp_, path_, ec);
  if (ec) {
    ::unlink(tmp_.c_str());
    fail(ErrorKind::io, "{}: cannot rename {} over it: {}", path_, tmp_, ec.message());
  }
  const auto parent = fs::path(path_).parent_path();
  fsync_path(parent.empty() ? fs::path(".") : parent, true);
}

bool is_model_or_adapter_folder(const std::string& dir) {
  std::error_code ec;
  const fs::path d(dir);
  if (fs::is_regular_file(d / "adapter_config.json", ec)) return true;
  if (!fs::is_regular_file(d / "config.json", ec)) return false;
  for (const auto& e : fs::directory_iterator(d, ec))
    if (e.path().extension() == ".safetensors") return true;
  return false;
}

void check_folder_replaceable(const std::string& dir, bool overwrite, std::string_view what, std::string_view force,
                              std::span<const std::string> keep) {
  const fs::path p = target_of(dir);
  if (p == p.root_path()) fail(ErrorKind::invalid_input, "{} '{}': cannot replace the root folder", what, dir);
  if (holds_current_dir(p))
    fail(ErrorKind::invalid_input, "{} '{}': the folder holds the current directory; writing it would replace it",
         what, dir);
  std::error_code ec;
  const fs::file_status st = fs::status(p, ec);
  if (!fs::exists(st)) return;
  if (!fs::is_directory(st)) fail(ErrorKind::invalid_input, "{} '{}': exists and is not a folder", what, dir);
  if (overwrite || is_model_or_adapter_folder(p.string())) return;
  fs::directory_iterator it(p, ec);
  if (ec) fail(ErrorKind::io, "{} '{}': cannot list the folder: {}", what, dir, ec.message());
  const auto kept = [&](const fs::path& e) {
    return std::find(keep.begin(), keep.end(), e.filename().string()) != keep.end();
  };
  while (it != fs::directory_iterator() && kept(it->path())) it.increment(ec);
  if (it == fs::directory_iterator()) return;
  fail(ErrorKind::invalid_input,
       "{} '{}': a non-empty folder (e.g. '{}') that is not a loom or PEFT output (no adapter_config.json, no "
       "config.json with .safetensors); writing replaces the whole folder: choose another folder or pass {}",
       what, dir, it->path().filename().string(), force);
}

bool path_within(const std::string& path, const std::string& dir) {
  std::error_code ec;
  const fs::path p = fs::weakly_canonical(fs::absolute(path), ec);
  fs::path d = fs::weakly_canonical(fs::absolute(dir), ec);
  if (!d.has_filename()) d = d.parent_path();  // "dir/"
  const auto [a, b] = std::mismatch(d.begin(), d.end(), p.begin(), p.end());
  (void)b;
  return a == d.end();
}

void check_folder_writable(const std::string& dir, std::string_view what) {
  const fs::path p = target_of(dir);
  std::error_code ec;
  fs::create_directories(p.parent_path(), ec);
  if (ec)
    fail(ErrorKind::io, "{} '{}': cannot create its parent folder {}: {}", what, dir, p.parent_path().string(),
         ec.message());
  if (fs::exists(p, ec) && !fs::is_directory(p, ec))
    fail(ErrorKind::io, "{} '{}': exists and is not a folder", what, dir);
  std::string tmpl = (p.parent_path() / (sibling_prefix(p, "new") + fmt::format("{}-XXXXXX", ::getpid()))).string();
  if (!::mkdtemp(tmpl.data()))
    fail(ErrorKind::io, "{} '{}': cannot write in its parent folder {}: {}", what, dir, p.parent_path().string(),
         std::strerror(errno));
  ::rmdir(tmpl.c_str());
}

void check_dir_writable(const std::string& dir, std::string_view what) {
  std::error_code ec;
  if (fs::exists(dir, ec) && !fs::is_directory(dir, ec))
    fail(ErrorKind::io, "{} '{}': exists and is not a folder", what, dir);
  fs::create_directories(dir, ec);
  if (ec) fail(ErrorKind::io, "{} '{}': cannot create the folder: {}", what, dir, ec.message());
  std::string tmpl = (fs::path(dir) / ".loom-probe-XXXXXX").string();
  const int fd = ::mkstemp(tmpl.data());
  if (fd < 0) fail(ErrorKind::io, "{} '{}': cannot write files in the folder: {}", what, dir, std::strerror(errno));
  ::close(fd);
  ::unlink(tmpl.c_str());
}

void check_writable_dry_run(const std::string& dir, std::string_view what, bool in_parent) {
  const fs::path p = target_of(dir);
  std::error_code ec;
  if (fs::exists(p, ec) && !fs::is_directory(p, ec))
    fail(ErrorKind::io, "{} '{}': exists and is not a folder", what, dir);
  fs::path at = in_parent ? p.parent_path() : p;
  while (!fs::exists(at, ec) && at.has_relative_path()) at = at.parent_path();
  if (!fs::is_directory(at, ec))
    fail(ErrorKind::io, "{} '{}': cannot create it: {} is not a folder", what, dir, at.string());
  if (::access(at.c_str(), W_OK | X_OK) != 0)
    fail(ErrorKind::io, "{} '{}': cannot write in {}: {}", what, dir, at.string(), std::strerror(errno));
  // access() answers yes to root everywhere, also where nothing can be created
  // (/proc, /sys): a folder made and removed at once is the real test.
  std::string probe = (at / ".loom-probe-XXXXXX").string();
  if (!::mkdtemp(probe.data()))
    fail(ErrorKind::io, "{} '{}': cannot create anything in {}: {}", what, dir, at.string(),
         std::strerror(errno));
  ::rmdir(probe.c_str());
}

void check_file_writable(const std::string& path, std::string_view what) {
  std::error_code ec;
  if (fs::is_directory(path, ec)) fail(ErrorKind::io, "{} '{}': a folder; give a file path", what, path);
  const fs::path parent = fs::path(path).parent_path();
  check_writable_dry_run(parent.empty() ? "." : parent.string(),
                         fmt::format("{} '{}': its folder", what, path),
                         /*in_parent=*/false);
}

bool recover_folder_write(const std::string& dest) {
  const fs::path p = target_of(dest);
  std::error_code ec;
  const std::string new_prefix = sibling_prefix(p, "new"), old_prefix = sibling_prefix(p, "old");
  std::vector<fs::path> stale_new, stale_old;
  for (const auto& e : fs::directory_iterator(p.parent_path(), ec)) {
    const std::string name = e.path().filename().string();
    if (const long pid = sibling_pid(name, new_prefix); pid > 0 && !process_runs(pid)) stale_new.push_back(e.path());
    if (const long pid = sibling_pid(name, old_prefix); pid > 0 && !process_runs(pid)) stale_old.push_back(e.path());
  }
  bool restored = false;
  if (!stale_old.empty() && !fs::exists(p, ec)) {  // crashed between the two renames: the old folder is complete
    rename_or_fail(stale_old.front(), p, p);
    fsync_path(p.parent_path(), true);
    stale_old.erase(stale_old.begin());
    restored = true;
  }
  for (const auto* list : {&stale_new, &stale_old})
    for (const fs::path& s : *list) fs::remove_all(s, ec);
  return restored;
}

void write_folder_atomic(const std::string& dest, const std::function<void(const std::string& staging)>& fill,
                         const FolderWriteOptions& opt) {
  const fs::path p = target_of(dest);
  const auto step = [&](std::string_view s) {
    if (opt.on_step) opt.on_step(s);
  };
  std::error_code ec;
  fs::create_directories(p.parent_path(), ec);
  if (ec) fail(ErrorKind::io, "{} '{}': cannot create folder {}: {}", opt.what, dest, p.parent_path().string(), ec.message());
  recover_folder_write(dest);
  check_folder_replaceable(dest, opt.overwrite, opt.what, opt.force, opt.keep);
  const fs::path staging = make_sibling(p, "new");
  fs::path old;  // where the replaced folder ends up, to be removed
  try {
    fill(staging.string());
    for (const std::string& k : opt.keep)
      if (fs::exists(fs::symlink_status(p / k, ec)) && !fs::exists(fs::symlink_status(staging / k, ec)))
        carry_entry(p / k, staging / k);
    step("staged");
    fsync_tree(staging);
    step("synced");
    if (!fs::exists(p, ec)) {
      rename_or_fail(staging, p, p);
      step("new_moved");
    } else if (opt.exchange && exchange_paths(staging, p, p)) {
      old = staging;
      step("swapped");
    } else {  // two renames; between them the old folder waits at a backup name
      const fs::path backup = make_sibling(p, "old");
      if (::rename(p.c_str(), backup.c_str()) != 0) {  // a folder may be renamed over an empty one
        const int err = errno;
        ::rmdir(backup.c_str());
        fail(ErrorKind::io, "{}: cannot move it to {}: {}", p.string(), backup.string(), std::strerror(err));
      }
      old = backup;
      step("old_moved");
      rename_or_fail(staging, p, p);
      step("new_moved");
    }
  } catch (...) {
    if (!old.empty() && old != staging && !fs::exists(p, ec)) ::rename(old.c_str(), p.c_str());  // put the old one back
    fs::remove_all(staging, ec);
    throw;
  }
  fsync_path(p.parent_path(), true);
  step("parent_synced");
  if (!old.empty()) fs::remove_all(old, ec);
  step("done");
}

uint64_t fnv1a64(std::string_view bytes, uint64_t seed) {
  uint64_t h = seed;
  for (unsigned char c : bytes) {
    h ^= c;
    h *= 0x100000001b3ull;
  }
  return h;
}

}  // namespace loom
