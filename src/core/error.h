// Internal code uses the public error type.
#pragma once
#include "fathom/error.h"
