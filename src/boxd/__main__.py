"""``python -m boxd`` is the ``boxd`` command (the SDK starts its local daemon this way)."""

from boxd.cli.main import main

if __name__ == "__main__":
    main()
