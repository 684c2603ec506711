// Whole-file writes through a temporary file and a rename, so a reader (or a
// crash) never sees half a file. Used by checkpoint, adapter and tensor writers.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

namespace loom {

// Creates missing parent folders, writes `bytes` to `path`.tmp and renames it
// over `path`. Throws loom::Error (io) naming the file on failure.
void write_file_atomic(const std::string& path, std::string_view bytes);

// 64-bit FNV-1a, for trailer checksums of loom's own binary files.
uint64_t fnv1a64(std::string_view bytes, uint64_t seed = 0xcbf29ce484222325ull);

}  // namespace loom
