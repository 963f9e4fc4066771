"""TFTP (RFC 1350, options RFC 2347-2349 and 7440): read-only, rooted at the assets folder."""
