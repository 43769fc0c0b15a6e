# SPDX-License-Identifier: Apache-2.0
# Type stub of lmcache_ascend/_build_info.py, which setup.py writes when it
# builds the native modules (not in the source tree): a type check needs no build.

TORCH_VERSION: str
