"""The comparison harness, apart from the library: FederatedScope runs as subprocesses and what they write.

- :mod:`~fs_fedpa.harness.compare`: a grid of methods x seeds x overrides through ``federatedscope.main``, resumable,
  tabulated (``python -m fs_fedpa.harness.compare``, ``fs-fedpa compare``);
- :mod:`~fs_fedpa.harness.plots`: its figures;
- :mod:`~fs_fedpa.harness.fs_command`: KEY VALUE overrides safe from FS's client-config split;
- :mod:`~fs_fedpa.harness.fs_results`: reading FS's ``eval_results.log`` and the clients' accounting files.

Nothing in the plugin or the math imports this package, except :mod:`~fs_fedpa.harness.fs_results` where a run's
own results are read back (the export's manifest, the console of ``fs-fedpa run``)."""
