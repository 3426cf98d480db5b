"""Connection URLs of networked tiers, safe to log or to answer with: apart from
tiers/redis.py, so that a daemon without the optional ``redis`` package still starts."""

from __future__ import annotations

import urllib.parse


def redact_url(url: str) -> str:
    """``url`` with its password (``user:PASSWORD@`` or ``?password=``) replaced by ``***``."""
    try:
        parts = urllib.parse.urlsplit(url)
        password = parts.password
    except ValueError:
        return "***"  # not a URL we can take apart: say nothing of it
    netloc = parts.netloc
    if password is not None:
        userinfo, _, hostport = netloc.rpartition("@")
        user = userinfo.partition(":")[0]
        netloc = f"{user}:***@{hostport}"
    query = urllib.parse.urlencode([(k, "***" if k.lower() == "password" else v)
                                    for k, v in urllib.parse.parse_qsl(parts.query, keep_blank_values=True)], safe="*")
    return urllib.parse.urlunsplit(parts._replace(netloc=netloc, query=query))
