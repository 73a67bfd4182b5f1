/** The left-sidebar panel: one widget rendering every section from the SidebarModel. */

import { ReactWidget, UseSignal } from '@jupyterlab/ui-components';
import type { Message } from '@lumino/messaging';
import * as React from 'react';

import type { SidebarModel } from './model';
import type { IClient } from './types';
import { ActivityView } from './views/activity';
import { ClientsView } from './views/clients';
import { ErrorLine } from './views/common';
import { ModelsView } from './views/models';
import { PairingsView } from './views/pairings';
import { ServiceView } from './views/service';
import { TasksView } from './views/tasks';
import { WebhooksView } from './views/webhooks';

export interface ISidebarOptions {
  model: SidebarModel;
  openLog: (taskId: string) => void;
  confirmRevoke: (client: IClient) => Promise<boolean>;
}

function Sidebar(props: ISidebarOptions): React.ReactElement {
  const { model } = props;
  return (
    <div
      className="jp-LMSP-sidebar"
      data-task-list={model.tasksLive ? 'lifecycle' : 'poll'}
    >
      <header className="jp-LMSP-header">
        <span className="jp-LMSP-title">Language models</span>
        <button
          type="button"
          className="jp-LMSP-button jp-LMSP-button-plain"
          data-action="refresh"
          title="Refresh now"
          onClick={() => void model.refresh()}
        >
          ↻
        </button>
      </header>
      {model.message ? (
        <div className="jp-LMSP-message">
          {model.message.kind === 'error' ? (
            <ErrorLine text={model.message.text} />
          ) : (
            <div className="jp-LMSP-info" role="status">
              {model.message.text}
            </div>
          )}
          <button
            type="button"
            className="jp-LMSP-dismiss"
            data-action="dismiss"
            title="Dismiss"
            onClick={() => model.clearMessage()}
          >
            ×
          </button>
        </div>
      ) : null}
      <PairingsView model={model} />
      <ServiceView model={model} />
      <ActivityView model={model} />
      <TasksView model={model} openLog={props.openLog} />
      <ModelsView model={model} />
      <ClientsView model={model} confirmRevoke={props.confirmRevoke} />
      <WebhooksView model={model} />
    </div>
  );
}

export class SidebarWidget extends ReactWidget {
  constructor(private readonly options: ISidebarOptions) {
    super();
    this.addClass('jp-LMSP-panel');
  }

  get model(): SidebarModel {
    return this.options.model;
  }

  protected render(): React.ReactElement {
    return (
      <UseSignal signal={this.options.model.changed}>
        {() => <Sidebar {...this.options} />}
      </UseSignal>
    );
  }

  protected onAfterShow(msg: Message): void {
    super.onAfterShow(msg);
    this.options.model.setActive(true);
  }

  protected onAfterHide(msg: Message): void {
    super.onAfterHide(msg);
    this.options.model.setActive(false);
  }

  dispose(): void {
    if (!this.isDisposed) {
      this.options.model.dispose();
    }
    super.dispose();
  }
}
