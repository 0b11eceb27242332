"""The research beside the plugin, not installed with it: the SST-2 study (``study``), the comparison harness
(``harness``), the ops tools (``tools``), scripts, benchmarks and their tests. Run from the checkout's root
(research/README.md)."""
