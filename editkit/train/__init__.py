"""Fine-tuning one task: the recipe, where it runs (``runtime``), and the loop."""
