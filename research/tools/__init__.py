"""The ops tools: the main job (``sst2_demo``), a host's GPU check and its preparation, the DP canary audit."""
