/** Paired clients with their scopes and last use; revoke. */

import * as React from 'react';

import { age, localTime } from '../format';
import type { SidebarModel } from '../model';
import type { IClient } from '../types';
import { Button, Empty, Section } from './common';

export function ClientsView(props: {
  model: SidebarModel;
  confirmRevoke: (client: IClient) => Promise<boolean>;
}): React.ReactElement {
  const { model } = props;
  const { data, error, loaded } = model.clients;
  const active = data.filter(c => c.revoked_at === null);
  const revoked = data.length - active.length;
  const revoke = (client: IClient): void => {
    void props.confirmRevoke(client).then(ok => (ok ? model.revoke(client.id) : undefined));
  };
  return (
    <Section title="Paired clients" name="clients" count={active.length} error={error}>
      {active.length ? (
        <ul className="jp-LMSP-list">
          {active.map(c => (
            <li key={c.id} className="jp-LMSP-row jp-LMSP-clientRow" data-client-id={c.id}>
              <div className="jp-LMSP-line">
                <span className="jp-LMSP-name" title={c.id}>
                  {c.name}
                </span>
                <span className="jp-LMSP-age" title={localTime(c.created_at)}>
                  {age(c.created_at)}
                </span>
              </div>
              <div className="jp-LMSP-line">
                <span className="jp-LMSP-sub jp-LMSP-grow" title={c.scopes.join(' ')}>
                  {c.last_used_at ? `used ${age(c.last_used_at)} ago` : 'never used'}
                  {' · '}
                  {c.scopes.join(' ')}
                </span>
                <span className="jp-LMSP-actions">
                  <Button
                    name="revoke"
                    kind="warn"
                    label="Revoke"
                    title="Revoke this client's token"
                    disabled={model.busy.has(`revoke:${c.id}`)}
                    onClick={() => revoke(c)}
                  />
                </span>
              </div>
            </li>
          ))}
        </ul>
      ) : loaded ? (
        <Empty text="No paired client." />
      ) : null}
      {revoked ? <div className="jp-LMSP-sub">{revoked} revoked</div> : null}
    </Section>
  );
}
