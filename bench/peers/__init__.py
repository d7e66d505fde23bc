"""The fleet routing bench's parts: the routers it runs beside kvfleet (sticky, blind), how every
contender is launched (launch), the observed stand-in workers (workers) and the report (report)."""
