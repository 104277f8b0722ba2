"""Private, authenticated local storage, shared by kvjax and its model loaders.

    cache_dir   kvjax's cache directory ($KVJAX_CACHE_DIR): where it is, whether it is private
                to this user (0700, ssh-style checks), and the per-user HMAC key that
                authenticates every entry read back from it
    files       files and directories written atomically (a reader sees the old one or the new
                one), and `arrays_digest`, the one digest of named arrays

It imports nothing of `kvjax` or `models`, so that both can use it while `models` stays free
of kvjax (its models implement kvjax's seam without importing it) and kvjax's core does not
depend on the model package.
"""
