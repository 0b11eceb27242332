"""Task data and metrics (GLUE, GSM8K, HumanEval): no FederatedScope imports."""
