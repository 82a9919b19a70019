"""The numeracy study: CE vs CE + SMMD vs ablations on held-out numeric problems (README.md here)."""
