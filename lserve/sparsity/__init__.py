"""Static (head-level) and dynamic (page-level) sparsity."""
