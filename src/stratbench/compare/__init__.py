"""stratbench compare: run a matrix of cells (method x precision x world size x batch) and report them side by side.

``matrix`` builds the cells (presets, YAML files, filters) and decides which cannot run on this machine;
``runner`` runs each cell in its own process tree with a time limit and records it in ``results.jsonl``;
``report`` turns the records into report.md / report.csv / report.html (from ``templates/report.html.j2``) and
PNG charts; ``summary`` writes the report's opening (what to use, a compact table, the cells that did not
complete) from the rows (``rows``) that ``report`` builds.
"""
