"""Developer scripts: regenerating golden files, checks on a GPU machine."""
