//! userfaultfd regions whose fixed-size slots are filled on fault or ahead of use, evicted and
//! tracked. Knows nothing about LLMs. Not built yet: see the uffd_handler issue.
