"""Every file format editkit reads or writes outside the bank's own store, in one room.

- :mod:`~editkit.io.layout`: the export directory's file names and format tag (what writer and reader share);
- :mod:`~editkit.io.export`: the export directory ``--out DIR`` writes, whole or not at all, and the ``--out``
  checks every writer applies (:func:`~editkit.io.export.check_target`);
- :mod:`~editkit.io.program`: ``model.pt2``, the edited model as a ``torch.export`` program;
- :mod:`~editkit.io.onnx`: ``model.onnx``, the program for ONNX Runtime, kept when it reproduces the scoring;
- :mod:`~editkit.io.native`: the edited weights in the backbone family's own format, and the heads;
- :mod:`~editkit.io.peft`: PEFT LoRA adapters, written and imported;
- :mod:`~editkit.io.card`: ``editkit.json`` and the model card;
- :mod:`~editkit.io.checkpoints`: fine-tuned checkpoints imported as vectors;
- :mod:`~editkit.io.tau`: a combination of banked vectors as a bare tensor file (``--tau-only``);
- :mod:`~editkit.io.read`: an export read back, needing nothing of training (``editkit predict``).

Nothing is imported here: reading an export must not pull in what writing one needs.
"""
