"""Real Nova on a loopback port, for the real-Nova tier of `cargo test`.

This is the project's own server, started once per test binary by
`tests/support/real_nova.rs` from the virtual environment it builds under
`target/`. It boots Nova 34's own functional-test stack in this process and
serves Nova's real compute API (its paste pipeline, controllers, policies,
conductor, scheduler and one compute host on the fake virt driver) on a real
socket, with:

- Keystone v3 password authentication at `/identity/v3/auth/tokens`, whose
  catalog names the compute endpoint the test harness gave (its fault proxy
  in front of this server), so the service runs in Keystone mode;
- in keystonemiddleware's place in Nova's `keystone` pipeline, a check of
  our tokens that sets the headers keystonemiddleware would (Nova 34 has no
  `noauth2`), so Nova's own context middleware makes the request context;
- a harness API under `/_harness/` (never through the fault proxy): faults
  injected inside Nova's flows (Cinder's attachment_create, the hypervisor's
  attach), token revocation, and the ground truth: every
  block-device mapping Nova created or destroyed, with its instant.

Why a test case class: `_IntegratedTestBase` is how Nova wires its own
functional tests (sqlite databases, `fake://` RPC, the Cinder, Glance and
Neutron fixtures, real Placement in process). It is set up once and never
torn down; the process ends when the test binary closes our stdin.

Nothing here is copied from Nova; it only calls Nova's public test helpers.
"""

import os
import sys

# Native threads, not eventlet (Nova refuses threading mode when eventlet
# was imported first, so this import must come before fixtures/oslo/webob).
os.environ['OS_NOVA_DISABLE_EVENTLET_PATCHING'] = '1'
# No per-test timeout: this "test" lasts as long as the test binary.
os.environ.pop('OS_TEST_TIMEOUT', None)
import nova.tests.functional  # noqa: E402,F401  (must be first)

import argparse  # noqa: E402
import collections  # noqa: E402
import contextlib  # noqa: E402
import datetime  # noqa: E402
import faulthandler  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import signal  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
import uuid  # noqa: E402

import keystonemiddleware.auth_token  # noqa: E402
from nova import exception  # noqa: E402
from nova import objects  # noqa: E402
from nova.tests import fixtures as nova_fixtures  # noqa: E402
from nova.tests.functional import integrated_helpers  # noqa: E402
import nova.virt.fake  # noqa: E402
import waitress  # noqa: E402

LOG = logging.getLogger('real_nova')

# Keystone project ids are 32 hex digits; ours are derived from the name so
# a test can name its project and know its id.
PROJECT_NS = uuid.UUID('6f1c1a43-0e5e-4b7c-9b1d-5f0c2b7e4a11')


def project_id(name):
    return uuid.uuid5(PROJECT_NS, name).hex


class Harness:
    """What the test harness controls and reads, shared by every thread."""

    def __init__(self, password):
        self.lock = threading.Lock()
        self.password = password
        self.compute_url = None
        # Our own URL (Keystone's, in a 401's WWW-Authenticate).
        self.base_url = None
        # token -> {user, user_id, project, project_id, roles, expires}
        self.tokens = {}
        self.issued = collections.Counter()
        # volume id -> how many attachment_create calls still fail
        self.cinder_failures = {}
        # volume ids whose hypervisor attach fails
        self.compute_failures = set()
        # The ground truth: every BDM of a volume Nova created or destroyed.
        self.effects = []

    def record(self, change, bdm):
        if bdm.source_type != 'volume' or not bdm.volume_id:
            return
        with self.lock:
            self.effects.append({
                'seq': len(self.effects),
                # The wall clock, as PostgreSQL's now() reads it on this
                # machine: the ledger's decision instants compare with it.
                't': time.time(),
                'change': change,
                'server_id': bdm.instance_uuid,
                'volume_id': bdm.volume_id,
                'bdm_uuid': bdm.uuid if 'uuid' in bdm else None,
            })

    def take_cinder_failure(self, volume_id):
        with self.lock:
            n = self.cinder_failures.get(volume_id, 0)
            if n <= 0:
                return False
            self.cinder_failures[volume_id] = n - 1
            return True


HARNESS = None


class HarnessCinder(nova_fixtures.CinderFixture):
    """Nova's Cinder fixture, plus the failures the harness injects.

    (Its one multiattach volume, MULTIATTACH_VOL, is the only one: the
    fixture's attachment_update refuses a second connection for any other
    volume, so a volume merely reported as multiattach cannot be shared.)"""

    def fake_attachment_create(self, context, volume_id, instance_uuid,
                               connector=None, mountpoint=None):
        # What nova.volume.cinder raises when Cinder cannot be reached.
        if HARNESS.take_cinder_failure(volume_id):
            raise exception.CinderConnectionFailed(
                reason='injected by the test harness')
        return super().fake_attachment_create(
            context, volume_id, instance_uuid, connector=connector,
            mountpoint=mountpoint)


def install_cell_targeting():
    """Cell targeting without the fixture's global switch, whose locks
    deadlock under native threads.

    Nova's `CellDatabases` fixture points un-targeted database access at
    "the cell targeted last", a global it switches under a reader-writer
    lock on every `target_cell` (a reader takes it for every un-targeted
    access too, and holds it across the targeted work), while its
    `DatabaseWriteLock` holds a per-database lock across every writer
    transaction. A thread in a writer transaction that reaches either lock
    waits behind a pending writer of the cell lock, which waits for readers
    that wait for the database lock that first thread holds: Nova stops,
    every RPC worker and API thread behind it. It hung the tier in CI, and
    here under load (stacks: readers in `_locked_scope`, a reader in
    `_wrap_target_cell`).

    Here a targeted context carries its cell's connection (Nova's own
    `target_cell` sets it, as in production) and an un-targeted access
    goes to the default cell, cell1, which is where every un-targeted
    access of a real deployment's cell services goes (cell0 is only ever
    reached by targeting). No cell lock is left. The writer lock becomes
    one re-entrant lock for all databases: SQLite still has one writer per
    file, and no two writer transactions on different databases can wait
    for each other in opposite orders."""
    fixture = nova_fixtures.CellDatabases

    @contextlib.contextmanager
    def _wrap_target_cell(self, context, cell_mapping):
        with self._real_target_cell(context, cell_mapping) as cctxt:
            yield cctxt

    def _wrap_get_context_manager(self, context):
        targeted = getattr(context, 'db_connection', None)
        return targeted or self._default_ctxt_mgr

    fixture._wrap_target_cell = _wrap_target_cell
    fixture._wrap_get_context_manager = _wrap_get_context_manager

    one = threading.RLock()
    nova_fixtures.DatabaseWriteLock._get_lock = lambda self, db_url: one


def dump_threads(signum, frame):
    """Every thread's stack, by name, to stderr (the harness's stderr.log):
    what the harness prints when Nova stops answering or a test outlives
    its bound. Runs in the main thread (waitress's loop wakes on the
    signal); faulthandler on SIGUSR2 is the fallback when it cannot (it
    dumps at most 100 threads, without names)."""
    names = {t.ident: t.name for t in threading.enumerate()}
    out = ['--- %d threads at %s ---' % (len(names), time.time())]
    for ident, f in sys._current_frames().items():
        out.append('Thread %s (%s):' % (ident, names.get(ident, '?')))
        out.extend(line.rstrip('\n')
                   for line in traceback.format_stack(f))
    sys.stderr.write('\n'.join(out) + '\n')
    sys.stderr.flush()


def install_hooks():
    """Ground truth and in-Nova faults, hooked where Nova's own code runs."""
    create = objects.BlockDeviceMapping._create
    destroy = objects.BlockDeviceMapping.destroy

    def _create(self, context, update_or_create=False):
        r = create(self, context, update_or_create=update_or_create)
        HARNESS.record('attached', self)
        return r

    def _destroy(self):
        r = destroy(self)
        HARNESS.record('detached', self)
        return r

    objects.BlockDeviceMapping._create = _create
    objects.BlockDeviceMapping.destroy = _destroy

    attach = nova.virt.fake.FakeDriver.attach_volume

    def attach_volume(self, context, connection_info, instance, mountpoint,
                      *args, **kwargs):
        volume_id = (connection_info or {}).get('data', {}).get('volume_id')
        with HARNESS.lock:
            fail = volume_id in HARNESS.compute_failures
        if fail:
            # A hypervisor that cannot attach: compute rolls the BDM back
            # and records the error in the instance action's event.
            raise exception.VolumeAttachFailed(
                volume_id=volume_id, reason='injected by the test harness')
        return attach(self, context, connection_info, instance, mountpoint,
                      *args, **kwargs)

    nova.virt.fake.FakeDriver.attach_volume = attach_volume


class NovaStack(integrated_helpers._IntegratedTestBase):
    """Nova's functional-test stack, set up once and kept."""

    # Casts stay asynchronous, as in production (the fixture's default turns
    # them into calls, which would hide the 2.101+ background attach).
    CAST_AS_CALL = False
    # keystonemiddleware's auth_token is replaced by our TokenCheck (see
    # main), in its place in Nova's pipeline; Nova's own context middleware
    # stays.
    STUB_KEYSTONE = False
    paste_config = None

    def _setup_services(self):
        # The test config assumes a source checkout; the wheel installs
        # api-paste.ini under <venv>/etc/nova.
        self.flags(api_paste_config=self.paste_config, group='wsgi')
        # FakeDriver, not SmallFakeDriver: room for every test's servers.
        self.flags(compute_driver='fake.FakeDriver')
        for q in ('instances', 'cores', 'ram'):
            self.flags(**{q: -1, 'group': 'quota'})
        super()._setup_services()

    def test_serve(self):
        """testtools needs a test method to name the case."""


def json_answer(start_response, status, body, headers=()):
    data = json.dumps(body).encode()
    start_response(status, [('Content-Type', 'application/json'),
                            ('Content-Length', str(len(data)))] + list(headers))
    return [data]


def read_json(environ):
    n = int(environ.get('CONTENT_LENGTH') or 0)
    raw = environ['wsgi.input'].read(n) if n else b''
    return json.loads(raw) if raw else {}


# The headers keystonemiddleware's auth_token sets for a valid token (and
# removes from what the client sent): Nova's NovaKeystoneContext makes the
# request context from them (with the request ids the middleware before it
# assigned).
AUTH_HEADERS = ('HTTP_X_IDENTITY_STATUS', 'HTTP_X_USER_ID', 'HTTP_X_USER_NAME',
                'HTTP_X_USER_DOMAIN_ID', 'HTTP_X_USER_DOMAIN_NAME',
                'HTTP_X_PROJECT_ID', 'HTTP_X_PROJECT_NAME',
                'HTTP_X_PROJECT_DOMAIN_ID', 'HTTP_X_PROJECT_DOMAIN_NAME',
                'HTTP_X_ROLES', 'HTTP_X_SERVICE_CATALOG')


class TokenCheck:
    """What keystonemiddleware's auth_token does for Nova, with our tokens:
    in its place in Nova's paste pipeline (so a 401 carries Nova's request
    ids, and version documents stay open), it answers a missing, invalid or
    revoked token with its 401 and sets the headers it sets for a valid
    one (and removes them from what the client sent)."""

    def __init__(self, app):
        self.app = app

    def __call__(self, environ, start_response):
        for h in AUTH_HEADERS:
            environ.pop(h, None)
        token = environ.get('HTTP_X_AUTH_TOKEN')
        with HARNESS.lock:
            t = HARNESS.tokens.get(token)
        if t is None or t['expires'] < time.time():
            body = json.dumps({'error': {
                'code': 401, 'title': 'Unauthorized',
                'message': 'The request you have made requires '
                           'authentication.'}}).encode()
            start_response('401 Unauthorized', [
                ('Content-Type', 'application/json; charset=UTF-8'),
                ('Content-Length', str(len(body))),
                ('WWW-Authenticate',
                 'Keystone uri="%s/identity"' % HARNESS.base_url)])
            return [body]
        environ.update({
            'HTTP_X_IDENTITY_STATUS': 'Confirmed',
            'HTTP_X_USER_ID': t['user_id'],
            'HTTP_X_USER_NAME': t['user'],
            'HTTP_X_USER_DOMAIN_ID': 'default',
            'HTTP_X_USER_DOMAIN_NAME': 'Default',
            'HTTP_X_PROJECT_ID': t['project_id'],
            'HTTP_X_PROJECT_NAME': t['project'],
            'HTTP_X_PROJECT_DOMAIN_ID': 'default',
            'HTTP_X_PROJECT_DOMAIN_NAME': 'Default',
            'HTTP_X_ROLES': ','.join(t['roles']),
        })
        return self.app(environ, start_response)


def token_check_factory(global_conf, **local_conf):
    """auth_token's paste filter factory, replaced (see main)."""
    return TokenCheck


class Front:
    """The WSGI app waitress serves: Keystone, the harness API, and Nova."""

    def __init__(self, nova_app, base_url):
        self.nova = nova_app
        self.base_url = base_url

    def __call__(self, environ, start_response):
        path = environ.get('PATH_INFO', '')
        try:
            if path.startswith('/identity'):
                return self.keystone(environ, start_response, path)
            if path.startswith('/_harness/'):
                return self.harness(environ, start_response, path)
        except Exception:
            LOG.exception('harness request %s failed', path)
            return json_answer(start_response, '500 Internal Server Error',
                               {'error': traceback.format_exc()})
        return self.nova(environ, start_response)

    def keystone(self, environ, start_response, path):
        if path.rstrip('/') == '/identity/v3' and \
                environ['REQUEST_METHOD'] == 'GET':
            return json_answer(start_response, '200 OK', {'version': {
                'id': 'v3.14', 'status': 'stable',
                'links': [{'rel': 'self',
                           'href': self.base_url + '/identity/v3/'}]}})
        if path != '/identity/v3/auth/tokens' or \
                environ['REQUEST_METHOD'] != 'POST':
            return json_answer(start_response, '404 Not Found', {'error': {
                'code': 404, 'title': 'Not Found',
                'message': 'The resource could not be found.'}})
        auth = read_json(environ).get('auth', {})
        ident = auth.get('identity', {})
        user = ident.get('password', {}).get('user', {})
        name, password = user.get('name'), user.get('password')
        project = auth.get('scope', {}).get('project', {}).get('name')
        if 'password' not in ident.get('methods', []) or not name or \
                password != HARNESS.password or not project:
            return self.unauthorized(start_response)
        admin = name == 'admin'
        roles = ['reader', 'member'] + (['admin'] if admin else [])
        token = 'gAAAA' + uuid.uuid4().hex
        expires = time.time() + 3600
        with HARNESS.lock:
            HARNESS.tokens[token] = {
                'user': name, 'user_id': name, 'project': project,
                'project_id': project_id(project), 'roles': roles,
                'expires': expires}
            HARNESS.issued[name] += 1
            compute_url = HARNESS.compute_url
        iso = datetime.datetime.fromtimestamp(
            expires, datetime.timezone.utc).strftime('%Y-%m-%dT%H:%M:%S.%fZ')
        body = {'token': {
            'methods': ['password'],
            'expires_at': iso,
            'user': {'id': name, 'name': name,
                     'domain': {'id': 'default', 'name': 'Default'}},
            'project': {'id': project_id(project), 'name': project,
                        'domain': {'id': 'default', 'name': 'Default'}},
            'roles': [{'id': r, 'name': r} for r in roles],
            'catalog': [{
                'type': 'compute', 'name': 'nova', 'id': 'nova',
                'endpoints': [{
                    'id': 'nova-public', 'interface': 'public',
                    'region': 'RegionOne', 'region_id': 'RegionOne',
                    'url': compute_url.rstrip('/') + '/v2.1'}]}],
        }}
        return json_answer(start_response, '201 Created', body,
                           [('X-Subject-Token', token)])

    def harness(self, environ, start_response, path):
        method = environ['REQUEST_METHOD']
        parts = path.strip('/').split('/')[1:]
        body = read_json(environ) if method in ('POST', 'PUT') else {}
        ok = '200 OK'
        if parts == ['tokens'] and method == 'GET':
            with HARNESS.lock:
                return json_answer(start_response, ok, {
                    'issued': dict(HARNESS.issued)})
        if parts == ['tokens', 'revoke'] and method == 'POST':
            user = body['user']
            with HARNESS.lock:
                gone = [t for t, v in HARNESS.tokens.items()
                        if v['user'] == user]
                for t in gone:
                    del HARNESS.tokens[t]
            return json_answer(start_response, ok, {'revoked': len(gone)})
        if parts == ['faults', 'cinder-attach'] and method == 'POST':
            with HARNESS.lock:
                HARNESS.cinder_failures[body['volume_id']] = \
                    int(body.get('count', 1))
            return json_answer(start_response, ok, {})
        if parts == ['faults', 'compute-attach'] and method == 'POST':
            with HARNESS.lock:
                HARNESS.compute_failures.add(body['volume_id'])
            return json_answer(start_response, ok, {})
        if parts == ['effects'] and method == 'GET':
            with HARNESS.lock:
                return json_answer(start_response, ok, {
                    'now': time.time(), 'effects': list(HARNESS.effects)})
        if parts == ['project-id'] and method == 'POST':
            return json_answer(start_response, ok,
                               {'id': project_id(body['name'])})
        return json_answer(start_response, '404 Not Found',
                           {'error': 'no such harness call: %s %s'
                                     % (method, path)})


def watch_stdin():
    """Ends the process when the test binary goes away (our stdin closes).
    Nova's service threads are not daemons: only os._exit ends them."""
    try:
        while sys.stdin.buffer.read(4096):
            pass
    finally:
        os._exit(0)


def main():
    global HARNESS
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument('--paste-config', required=True)
    p.add_argument('--password', required=True)
    p.add_argument('--compute-url', required=True,
                   help="the compute endpoint Keystone's catalog names "
                        "(the harness's fault proxy in front of this server)")
    p.add_argument('--log-file', required=True)
    p.add_argument('--threads', type=int, default=32)
    args = p.parse_args()

    threading.Thread(target=watch_stdin, daemon=True).start()
    # SIGUSR1: every thread's stack, named, to stderr (stderr.log); SIGUSR2:
    # the same from C (faulthandler), GIL or not, for when the first cannot
    # run.
    signal.signal(signal.SIGUSR1, dump_threads)
    faulthandler.register(signal.SIGUSR2, all_threads=True)
    HARNESS = Harness(args.password)
    HARNESS.compute_url = args.compute_url
    # Our Cinder fixture instead of Nova's (same behaviour, plus faults).
    nova_fixtures.CinderFixture = HarnessCinder
    install_hooks()
    install_cell_targeting()

    NovaStack.paste_config = args.paste_config
    # Our token check where keystonemiddleware's auth_token is (it would ask
    # a real Keystone). Not the fixture's stub: that one also replaces
    # Nova's context middleware with contexts that lack the request ids the
    # middleware assigned, so instance actions would carry ids no answer
    # ever named.
    keystonemiddleware.auth_token.filter_factory = token_check_factory
    stack = NovaStack('test_serve')
    stack.setUp()
    # Nova's log to a file the harness names when a test fails (the test
    # fixtures keep theirs in memory only).
    handler = logging.FileHandler(args.log_file)
    handler.setFormatter(logging.Formatter(
        '%(asctime)s %(threadName)s %(levelname)s %(name)s %(message)s'))
    handler.setLevel(logging.INFO)
    logging.getLogger().addHandler(handler)

    front = Front(stack.api_fixture.app(), None)
    server = waitress.create_server(
        front, host='127.0.0.1', port=0, threads=args.threads,
        # Nova's own WSGI servers keep idle connections a while; the
        # service's pool reuses them.
        channel_timeout=300, ident='real-nova')
    # Known once bound (port 0: the kernel picks a free one).
    front.base_url = 'http://127.0.0.1:%s' % server.effective_port
    HARNESS.base_url = front.base_url
    print('READY %s' % front.base_url, flush=True)
    server.run()


if __name__ == '__main__':
    try:
        main()
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        # Nova's non-daemon threads would keep a failed start alive.
        os._exit(1)
