"""Several serving processes behind one port: supervisor, control plane, peers."""
