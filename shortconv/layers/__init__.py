"""Model building blocks; TP-aware (column/row/vocab parallel) and pool-state aware."""
