"""How guidespec is started: the process launcher, the command line (later the server, Ray)."""
