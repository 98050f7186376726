"""Stand-in for IPython (not installed beside the engines): sglang/utils.py imports
`IPython.display` at module level for notebook helpers a server never calls."""
