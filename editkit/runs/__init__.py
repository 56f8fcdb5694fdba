"""What users run: streams, add / negate, the bench, and their reports."""
