// Whole-file and whole-folder writes that a reader (or a crash) never sees half
// done. Files: temporary file, fsync, rename. Folders: a staged sibling folder
// swapped into place (see write_folder_atomic). Used by checkpoint, adapter,
// tensor and model-folder writers.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <span>
#include <string_view>
#include <vector>

namespace loom {

// Creates missing parent folders, writes `bytes` to `path`.tmp, fsyncs it and
// renames it over `path`. Throws loom::Error (io) naming the file on failure.
void write_file_atomic(const std::string& path, std::string_view bytes);

// A large file written as a stream and published whole: bytes go to
// `path`.tmp.PID; commit() flushes, fsyncs and renames it over `path` (and
// fsyncs the parent). Destroyed without commit() (an error, an exception
// unwinding), the temporary file is removed and `path` is untouched. For
// outputs too big to hold in memory: GGUF models, perplexity log-prob files.
class AtomicFileWriter {
 public:
  // Creates missing parent folders and opens the temporary file. Throws io.
  explicit AtomicFileWriter(std::string path);
  ~AtomicFileWriter();
  AtomicFileWriter(const AtomicFileWriter&) = delete;
  AtomicFileWriter& operator=(const AtomicFileWriter&) = delete;

  void write(const void* data, size_t n);  // throws io naming `path`
  void write(std::string_view bytes) { write(bytes.data(), bytes.size()); }
  // Zero bytes up to the next multiple of `alignment` of the bytes written.
  void pad_to(size_t alignment);
  uint64_t size() const { return written_; }
  void commit();
  const std::string& path() const { return path_; }

 private:
  std::string path_, tmp_;
  int fd_ = -1;
  uint64_t written_ = 0;
  std::vector<char> buf_;
  void flush_buffer();
};

// Whether `dir` holds an output loom writes (or reads): a PEFT adapter
// (adapter_config.json) or a model folder (config.json and a .safetensors file).
bool is_model_or_adapter_folder(const std::string& dir);

// Throws (invalid_input) unless writing the folder `dir` as a whole may
// replace what is there: nothing, an empty folder, is_model_or_adapter_folder,
// or anything when `overwrite` (then the folder and all it holds are replaced).
// Never allowed: `dir` is a file, or holds the current directory. `what`
// names the setting in messages (e.g. "output_dir"); `force` says how to
// overwrite (e.g. "--overwrite"). Top-level entries named in `keep` (see
// FolderWriteOptions::keep) do not count as content.
void check_folder_replaceable(const std::string& dir, bool overwrite, std::string_view what, std::string_view force,
                              std::span<const std::string> keep = {});

// `path` (a file or folder, existing or not) is `dir` or lies inside it,
// symbolic links resolved.
bool path_within(const std::string& path, const std::string& dir);

// Checks, before any long work, that write_folder_atomic(dir) can stage its
// folder: creates the missing parents of `dir` and a probe folder beside it
// (removed again). Throws io naming `what` and the path.
void check_folder_writable(const std::string& dir, std::string_view what);

// Checks that `dir` is (or can be created as) a folder that files can be
// written into, by creating and removing a probe file. Throws io naming `what`.
void check_dir_writable(const std::string& dir, std::string_view what);

// The dry-run twin of both (`loom train --check`): leaves nothing behind. The
// folder the writes go to (`dir`'s parent when `in_parent`, as for
// check_folder_writable; else `dir`, as for check_dir_writable), or where it
// does not exist yet its nearest existing ancestor, must be a folder this
// process may write in (access W_OK | X_OK, then a probe folder made there and
// removed at once); `dir` itself, if it exists, must be a folder. Throws io
// naming `what` and the path.
void check_writable_dry_run(const std::string& dir, std::string_view what, bool in_parent);

// Before a long job that ends by writing the file `path`: it is not a folder, and its folder (or the
// nearest existing ancestor) can be written in. Creates nothing. Throws io naming `what` and the path.
void check_file_writable(const std::string& path, std::string_view what);

struct FolderWriteOptions {
  bool overwrite = false;             // see check_folder_replaceable
  std::string_view what = "output folder";
  std::string_view force = "--overwrite";
  // Linux renameat2(RENAME_EXCHANGE) swap; false (or a file system without
  // it) uses two renames through a backup sibling.
  bool exchange = true;
  // Top-level entries of the folder being replaced that the new one keeps
  // (a training output_dir's "checkpoints"): not counted as content by
  // check_folder_replaceable, and carried into the staged folder as hard links
  // (copies where a link fails) before the swap, so a crash at any instant
  // leaves them in `dest`.
  std::vector<std::string> keep;
  // Test hook: called at each commit step ("staged", "synced", "swapped",
  // "old_moved", "new_moved", "parent_synced", "done").
  std::function<void(std::string_view step)> on_step;
};

// Writes the folder `dest` as a whole: `fill(staging)` writes every file into
// a fresh sibling folder `.NAME.loom-new-PID-N` (same parent, same file
// system); its files and the folder are fsynced; then it takes the place of
// `dest` (rename when `dest` is absent, else an atomic swap, then the parent is
// fsynced and the old folder removed).
// Guarantee, for a crash (SIGKILL, power loss after fsync) at any instant:
// the path `dest` holds the complete old folder or the complete new one. With
// the two-rename fallback there is one window (between the renames) in which
// `dest` is absent and the complete old folder is at `.NAME.loom-old-PID-N`;
// recover_folder_write() (run first by every write_folder_atomic to `dest`)
// moves it back. Leftover staging folders of dead processes are removed then.
// If `fill` throws, the staging folder is removed and `dest` is untouched.
void write_folder_atomic(const std::string& dest, const std::function<void(const std::string& staging)>& fill,
                         const FolderWriteOptions& opt = {});

// Finishes what a crashed write_folder_atomic to `dest` left: restores the old
// folder when `dest` is missing, removes staging and backup siblings of
// processes that no longer run. Returns true when it restored `dest`.
bool recover_folder_write(const std::string& dest);

// 64-bit FNV-1a, for trailer checksums of loom's own binary files.
uint64_t fnv1a64(std::string_view bytes, uint64_t seed = 0xcbf29ce484222325ull);

}  // namespace loom
