"""The pipeline over `pipe`: schedules as tick tables, the one executor, layer order."""
