"""
What each script prints on a measured step: the numbers measured (tensors held, the clock, this rank's own
socket bytes), counted (the tensors handed to our collectives) and modelled (the papers' formulas in
formulas.py), side by side in one table (measure.print_measured), and one log.jsonl row per rank. The scripts
measure; this file only lays their numbers out, one function per script.
"""

# === zero.py ===
# === end zero.py ===

# === tensor_parallel.py ===
# === end tensor_parallel.py ===

# === pipeline.py ===
# === end pipeline.py ===

# === parallel_4d.py ===
# === end parallel_4d.py ===
