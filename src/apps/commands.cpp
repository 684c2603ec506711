#include "apps/commands.h"

namespace loom::app {

const std::vector<Command>& commands() {
  static const std::vector<Command> table = {};
  return table;
}

}  // namespace loom::app
