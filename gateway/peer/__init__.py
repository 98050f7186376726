"""Between the serving processes of one gateway: aborts reach the process holding the
request, and the supervisor reads each process's metrics."""
