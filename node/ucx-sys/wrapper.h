/* Headers that ucx-sys binds. ucp.h pulls in ucs/type/status.h, thread_mode.h, etc. */
#include <ucp/api/ucp.h>
#include <ucs/type/status.h>
