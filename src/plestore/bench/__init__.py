"""`plestore bench`: every known method side by side with the machine's limits."""
