"""``rlt bench``: workloads, metrics and side-by-side comparisons."""
