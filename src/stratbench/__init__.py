"""stratbench: train one PyTorch model under every common training method and compare them side by side.

From Python, ``from stratbench.api import TrainConfig, train, compare, estimate``: the commands of the same name,
returning their results instead of printing them.

The package is layered; a module imports only from its own folder or the folders above it in this list
(docs/architecture.md):

- ``core``         errors, config, the user's code, precision, optimizer, process groups, atomic files, tables
- ``models``       the model zoo, FLOPs per sample, the split into stages
- ``data``         data sets, samplers, the on-device input pipeline
- ``measuring``    clocks, memory, NVML, environment, traces, communication volume, hardware profiles, RunMetrics
- ``checkpoints``  full files, sharded folders, safe loads, one reader per layout
- ``strategies``   one file per training method: runtime, checkpoint I/O, cost model
- ``training``     the one training loop, losses, train state, result sinks
- ``predicting``   memory estimate, time projection, advice
- ``launching``    this process or torchrun, the job around a run
- ``inference``    predict, evaluate, ONNX export, parity
- ``compare``      the matrix of cells, the runner, calibration, records, the report
- ``api``, ``commands``, ``cli``  the Python API and the command line
"""

__version__ = "0.1.0"
