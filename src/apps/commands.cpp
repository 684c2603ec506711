#include "apps/commands.h"

namespace loom::app {

extern const Command kInfoCommand;
extern const Command kTokenizeCommand;
extern const Command kGenerateCommand;
extern const Command kChatCommand;
extern const Command kBenchCommand;
extern const Command kMergeCommand;
extern const Command kTrainCommand;
extern const Command kServeCommand;
extern const Command kPlotCommand;
extern const Command kPerplexityCommand;
extern const Command kQuantizeCommand;
extern const Command kImatrixCommand;
extern const Command kExportCommand;
extern const Command kExportLoraCommand;
extern const Command kPruneCommand;
extern const Command kProfileCommand;

const std::vector<Command>& commands() {
  static const std::vector<Command> table = {kInfoCommand, kTokenizeCommand, kGenerateCommand, kChatCommand,
                                             kBenchCommand, kPerplexityCommand, kImatrixCommand, kQuantizeCommand, kExportCommand, kExportLoraCommand, kPruneCommand, kMergeCommand, kTrainCommand, kPlotCommand,
                                             kServeCommand, kProfileCommand};
  return table;
}

}  // namespace loom::app
