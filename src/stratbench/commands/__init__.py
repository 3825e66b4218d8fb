"""Sub-commands of the ``stratbench`` CLI, one module each (discovered by ``stratbench.cli``)."""
