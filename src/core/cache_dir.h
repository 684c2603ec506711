// Where loom keeps what it measured about this machine (peaks, step costs), and
// the identities such a measurement is keyed by, so later runs skip it unless
// what it measured has changed.
#pragma once

#include <string>

namespace loom {

// $XDG_CACHE_HOME/loom, else $HOME/.cache/loom (empty when neither is set).
std::string user_cache_dir();

// "path:size:mtime" of a file or folder (a folder's size is 0): changes when it
// is rebuilt or replaced. "unknown" when it cannot be read.
std::string file_identity(const std::string& path);

// file_identity() of the running executable: a new build measures again.
std::string executable_identity();

}  // namespace loom
