"""``python -m editkit`` runs the ``editkit`` command; under torchrun:
``torchrun --nproc_per_node N -m editkit stream --scenario vision8 ...``."""

from cli import app


def main() -> None:
    app(prog_name="editkit")


if __name__ == "__main__":
    main()
