"""The SST-2 study built on the plugin: its protocol, statistics, runner, report and figures.

Nothing outside this subpackage imports it; ``python -m research.study.sst2_compare`` runs it.
"""
