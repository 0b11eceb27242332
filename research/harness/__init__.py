"""The comparison harness, beside the plugin: FederatedScope runs as subprocesses and what they write.

- :mod:`~research.harness.compare`: a grid of methods x seeds x overrides through ``federatedscope.main``, resumable,
  tabulated (``python -m research.harness.compare``);
- :mod:`~research.harness.plots`: its figures;
- :mod:`~research.harness.fs_command`: KEY VALUE overrides safe from FS's client-config split;
- :mod:`~research.harness.fs_results`: each client's last evaluation and the DP-SGD clients' accounting files; the
  weighted averages of FS's ``eval_results.log`` are the plugin's own reader (:mod:`fs_fedpa.fs_results`, which
  ``fs-fedpa run`` and the export use)."""
