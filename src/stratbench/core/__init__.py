"""What every layer shares: errors, the run config, the user's code, dtype policies (precision), process-group helpers, tables, progress lines, the output-folder lock."""
