"""FederatedScope glue: the only part of fs_fedpa that imports ``federatedscope``."""
