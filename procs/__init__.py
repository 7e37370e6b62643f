"""Process shells, one per OS-process role; installed as ``dflash_ipc.procs``."""
