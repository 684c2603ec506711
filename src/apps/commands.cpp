#include "apps/commands.h"

namespace loom::app {

extern const Command kInfoCommand;
extern const Command kTokenizeCommand;
extern const Command kGenerateCommand;
extern const Command kChatCommand;
extern const Command kBenchCommand;

const std::vector<Command>& commands() {
  static const std::vector<Command> table = {kInfoCommand, kTokenizeCommand, kGenerateCommand, kChatCommand,
                                             kBenchCommand};
  return table;
}

}  // namespace loom::app
