"""What a tuning run leaves in its results folder, as DeepSpeed's autotuner lays it out and more:
`outputs` (results.jsonl, summary.txt with the space searched and the winner's readings,
ds_config_optimal.json, cmd_optimal.txt: the command that launches what was tuned) with `rows` (the
results files' rows, typed: a record, or an experiment an interrupt cut off) and `plot`
(throughput per stage and size, drawn from the records); `model_fit` (the cost model's predictions
against the readings, a summary section and a plot); `mlflow_log` (the job as MLflow runs, when
MLFLOW_TRACKING_URI is set) with `mlflow_fields` (what those runs show, pure).

Imports: `scheduler.search` (ranking, the space), `scheduler.inputs`, `scheduler.errors`, `workers` (the
typed records, the results folder's file names, the failure vocabulary, the start-up timeline).
Imported by: cluster (records are written as they arrive) and the commands (MLflow: the tuning command).
"""
