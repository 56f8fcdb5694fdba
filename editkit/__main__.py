"""``python -m editkit`` runs the ``editkit`` command; under torchrun:
``torchrun --nproc_per_node N -m editkit stream --scenario vision8 ...``."""

from editkit.cli import run

if __name__ == "__main__":
    run()
