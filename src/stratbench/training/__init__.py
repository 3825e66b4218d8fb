"""The one training loop (engine) and what it feeds: loss, train state, result sinks (CSV, TensorBoard, MLflow, W&B)."""
