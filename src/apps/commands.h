// The table of `loom` subcommands. Each command parses its own flags (CLI11)
// and returns the process exit code; errors propagate as loom::Error.
#pragma once

#include <vector>

namespace loom::app {

struct Command {
  const char* name;
  int (*run)(int argc, char** argv);
};

const std::vector<Command>& commands();

}  // namespace loom::app
