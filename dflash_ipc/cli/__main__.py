"""``python -m dflash_ipc.cli``: the `dflash-ipc` command."""

from dflash_ipc.cli import main

if __name__ == "__main__":
    main()
