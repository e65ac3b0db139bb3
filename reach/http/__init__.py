"""The HTTP doors' shared pieces: the browser threat model (``guard``), serving an app on
a socket (``serve``) and the OAuth 2.1 login of the gateways (``oauth``)."""
