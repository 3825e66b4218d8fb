"""stratbench compare: run a matrix of cells (method x precision x world size x batch) and report them side by side.

``matrix`` builds the cells (presets, YAML files, filters) and decides which cannot run on this machine;
``runner`` runs each cell in its own process tree with a time limit and records it in ``results.jsonl``;
``report`` turns the records into report.md / report.csv / report.html and PNG charts.
"""
