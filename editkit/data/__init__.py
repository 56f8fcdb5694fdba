"""Task data and the sources that produce it: the registries ``TASK_SOURCES``, ``GENERIC_SOURCES``,
``TEXT_CORPORA`` and ``LABELLED_TEXTS``.

The built-in sources (packaged offline datasets, vision8, natural-image crops, text as
language-modelling data, the offline toxic / clean / prompt corpora, the offline text-classification
datasets, the Hugging Face copies of Civil Comments and WikiText-103, GLUE in text-to-text form, a user's
image folders, tables and text files: ``imagefolder:``, ``csv:``, ``jsonl:``, ``parquet:``, ``hf-dataset:`` and
the corpora ``file:PATH``) register themselves in their own modules, imported below; what they read from disk or the
network is loaded only when a builder runs.
"""

from editkit.core.registry import Record, Registry

TASK_SOURCES: Registry[Record] = Registry("task source")
"""Source kind -> record whose ``build(name, dataset, backbone, **options)`` returns a
:class:`~editkit.data.tasks.TaskData` for a scenario's ``source = "kind:dataset"`` (options: the ``[data]``
table and the ``[[tasks]]`` entry's own keys); its ``check(name, dataset, **options)`` lists missing data."""
GENERIC_SOURCES: Registry[Record] = Registry("generic source")
"""Kind -> record whose ``build(backbone, seed, **options)`` returns the always-available
:class:`~editkit.core.taujp.UnlabeledSource` of a ``[generic]`` table."""
TEXT_CORPORA: Registry[Record] = Registry("text corpus")
"""Corpus name -> record whose ``build(split, seed=0)`` returns the texts of one split (``train`` / ``val`` /
``test``) of a named text corpus; its ``check()`` lists what is missing. The family ``file:PATH`` names a
user's text file."""
LABELLED_TEXTS: Registry[Record] = Registry("text-classification dataset")
"""Dataset name -> record whose ``build(split, seed=0)`` returns a :class:`~editkit.data.tasks.LabelledTexts`
(texts, class ids, class names) of one split (``train`` / ``val`` / ``test``) of a named text-classification
dataset; its ``check()`` lists what is missing."""

from editkit.data import (glue, hf_text, natural, offline_text, packaged, split, text, text_classification,  # noqa: E402,F401
                          toxic_corpus, user_data, user_images, vision8)  # (built-in extensions register themselves)
