"""fairgate-package: gateway

The aiohttp gateway (`gateway.app.make_app`): auth, admission, fair queue, dispatch, proxy.
"""
