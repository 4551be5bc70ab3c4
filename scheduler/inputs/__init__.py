"""What the user gives, checked once at the door: the DeepSpeed config with its `autotuning` section
(`config`, read by `config_file`, checked by `config_schema` for every key's type and range and by
`memory_strategies` for the strategies' key, the search's keys typed by `search_keys`, the global
batch's by `batch_keys`, full mode's spaces by `full_mode`, named as DeepSpeed names their points by
`experiment_names`; one `error:` line naming the key and the fix), the command's arguments
(`arguments`: DeepSpeed's autotuner's flags and ours) and the results folder (`folders`: a path that
cannot escape, a marker so a folder is never taken from another tool).

Its own package, below the search, because every layer reads the user's input and none may reach
up into another to do it.

Imports: `scheduler.errors`, `workers.files`. Imported by: search, cluster and the commands.
"""
